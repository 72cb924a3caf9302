"""Distributed SGD with any of mpicoll's training methods on one problem: ``mpicoll train``.

A *method* is a way of training (``allreduce-ring``, ``ps-async``, ``sgp``,
...): one row of :data:`METHODS`, naming its runner and, where it has them,
the collective algorithm, the server rule or the default transport it uses.
Every method spends the same budget, ``epochs`` passes over the training
set counted over all workers, on the same model, data, batches and seed, so
runs compare: synchronous ones (allreduce, ps-sync, SGP) take equal steps on
every rank; asynchronous parameter servers let fast workers take more steps
than slow ones until the servers have seen the whole budget.  One rank (rank
0, or the first worker of a parameter-server job) evaluates on the test set
after each epoch, draws the progress bar and writes the log.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import arrays, compute, gossip, ps
from ..base import checkpoint, config, failure, timeline
from ..collectives.algorithms import auto
from ..collectives.communicator import Communicator
from ..base.errors import Diverged
from ..base.tags import Tag
from ..channel.checks import agree, all_finite, load_checkpoint_set
from ..channel.watchdog import bounded
from ..base.straggler import Straggler, parse as parse_straggler, parse_delay
from .data import Dataset
from ..models.dense import Model
from .report import Reporter, check_log
from . import schedule as schedules

__all__ = ["Options", "Method", "METHODS", "train", "reporting_rank"]


@dataclass
class Options:
    method: str = "allreduce-ring"
    epochs: int = 10
    batch: int = 32                   # samples per gradient, per worker
    lr: float = 0.1
    lr_schedule: str = "constant"     # constant, cosine or step:F1,F2,... over the budget (.schedule)
    seed: int = 0
    straggler: str | None = None      # "RANK=FACTOR"
    delay: str | None = None          # per-step sleep drawn from a distribution, e.g. "gamma:2,1.5" (ms)
    servers: int = 1                  # parameter servers
    softsync_k: float = 0.5           # ps-softsync: a count, or a fraction of the workers
    staleness: str = "tau"            # ps-async: none, tau or workers
    lam: float = 0.04                 # dcasgd
    adaptive: bool = False            # dcasgd-a
    n_fetch: int = 1                  # downpour
    n_push: int = 1
    warm_start: int = 0
    transport: str = "p2p"            # ps: how workers reach servers, p2p or onesided
    mailbox: str = "p2p"              # sgp: how gossip arrives, p2p or onesided
    graph: str = "time-varying-exponential"
    tau: int = 0                      # sgp overlap
    model_parallel: int = 1           # allreduce methods: stages per replica (mpicoll.modelparallel)
    max_rank_memory: int = 0          # allreduce methods: bytes of training state one rank may hold (0: no limit)
    history: int = 10                 # sandblaster-lbfgs: L-BFGS pairs kept
    lbfgs_batch: int = 0              # sandblaster-lbfgs: rows per iteration (0: all, full-batch L-BFGS)
    portions: int = 0                 # sandblaster-lbfgs: pieces per gradient evaluation (0: 4 per worker)
    backup: bool = True               # sandblaster-lbfgs: backup copies of the slowest portions
    output: str | None = None         # JSON lines log
    checkpoint: str | None = None     # path prefix: state saved after every epoch
    resume: bool = False              # continue from the checkpoint
    overwrite: bool = False           # a fresh run may replace an earlier run's checkpoint
    progress: bool = True
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args) -> "Options":
        """The options of an ``mpicoll train`` command line (every field of the same name)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**given, progress=not getattr(args, "quiet", False))


def _batches(rows: int, batch: int, steps: int, seed) -> list[np.ndarray]:
    """``steps`` batches of row indices from a fresh permutation per pass (same on every run)."""
    rng, order, out = np.random.default_rng(seed), np.empty(0, np.int64), []
    while len(out) < steps:
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(rows)])
        out.append(order[:batch])
        order = order[batch:]
    return out


def train(comm: MPI.Intracomm, options: Options, model: Model, data: Dataset, xp=np) -> dict | None:
    """Run one training job; returns the summary record on the reporting rank, None elsewhere.

    Before any rank starts, every rank checks what could stop it (options, the
    output folder, checkpoints); a problem on any rank raises the same
    :class:`mpicoll.SetupError` on all of them.
    """
    if options.method not in METHODS:
        raise ValueError(f"Unrecognized method: {options.method!r}; choose from {', '.join(METHODS)}")
    method = METHODS[options.method]
    run = _identity(comm, options, model, data) if options.checkpoint else {}
    agree(comm, lambda: _preflight(comm, options, model, data, method, run))
    if options.checkpoint and not options.resume:     # --overwrite: no file of the earlier run may remain
        if comm.Get_rank() == 0:
            checkpoint.discard(options.checkpoint)
        with bounded(comm, "removing the earlier run's checkpoint"):
            comm.barrier()
    if xp is np:
        compute.warm_up(model.dtype, model.size)     # kernels ready before any method's clock starts
    return method.runner(comm, options, model, data, xp, method, run)


def _identity(comm, options: Options, model: Model, data: Dataset) -> dict:
    """What this run's checkpoints belong to: resuming needs the same method, model, data and ranks."""
    cut = {"model_parallel": options.model_parallel} if options.model_parallel > 1 else {}
    return {"method": options.method, "model": getattr(model, "name", type(model).__name__),
            "parameters": int(model.size), "data": data.fingerprint(), "ranks": comm.Get_size(), **cut}


def _finite(value) -> bool:
    return math.isfinite(value)


# Every numeric option's range: (field, test, what the test asks).  Checked on every rank before any starts.
_RANGES = [
    ("epochs", lambda v: v >= 1, "at least 1"),
    ("batch", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: _finite(v) and v > 0, "a positive finite number"),
    ("seed", lambda v: v >= 0, "at least 0"),
    ("servers", lambda v: v >= 1, "at least 1"),
    ("softsync_k", lambda v: _finite(v) and v > 0, "positive: a count of workers, or a fraction of them"),
    ("lam", lambda v: _finite(v) and v >= 0, "a finite number, at least 0"),
    ("n_fetch", lambda v: v >= 1, "at least 1"),
    ("n_push", lambda v: v >= 1, "at least 1"),
    ("warm_start", lambda v: v >= 0, "at least 0"),
    ("tau", lambda v: v >= 0, "at least 0"),
    ("model_parallel", lambda v: v >= 1, "at least 1"),
    ("max_rank_memory", lambda v: v >= 0, "at least 0 bytes"),
    ("history", lambda v: v >= 1, "at least 1"),
    ("lbfgs_batch", lambda v: v >= 0, "at least 0 (0: the whole training set)"),
    ("portions", lambda v: v >= 0, "at least 0 (0: 4 per worker)"),
]


def _check_ranges(options: Options) -> None:
    """Raise naming the first option outside its range, as the command line spells it."""
    for name, test, wanted in _RANGES:
        value = getattr(options, name)
        if not test(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {wanted}, got {value}")


def _preflight(comm, options: Options, model: Model, data: Dataset, method: "Method", run: dict) -> None:
    """Raise (on this rank) what would stop this rank's part of the job, before anything is written."""
    rank, size = comm.Get_rank(), comm.Get_size()
    config.check_all()                      # every MPICOLL_ setting parses, or is named
    auto.check_settings()
    _check_ranges(options)
    slow = [r for r in parse_straggler(options.straggler) if not 0 <= r < size]
    if slow:
        raise ValueError(f"--straggler {options.straggler}: rank {slow[0]} is not among the {size} ranks")
    parse_delay(options.delay)
    schedules.parse(options.lr_schedule, options.lr)
    if options.model_parallel != 1:
        _check_model_parallel(options, model, method, size)
    if options.max_rank_memory:
        _check_memory(options, model, method, size)
    if method.runner is _sandblaster:
        _check_sandblaster(options, size)
    if method.one_rank and size > 1:
        raise ValueError(f"{options.method} is plain SGD on one process, the reference the distributed methods' "
                         f"updates are compared with: run it with mpiexec -n 1, not {size} ranks")
    parameter_server = method.rule is not None
    workers = size - options.servers if parameter_server else size
    if len(data.y) < workers:
        raise ValueError(f"{workers} workers but only {len(data.y)} training samples: every worker needs a shard; "
                         "use fewer ranks or more data")
    if parameter_server and size <= options.servers:
        raise ValueError(f"{options.method} needs more ranks than its {options.servers} server(s): "
                         f"mpiexec -n {options.servers + 1} or more")
    if options.output and rank == reporting_rank(options, method):
        _check_writable("--output", Path(options.output))
        check_log(options.output, options.overwrite, options.resume)
    if not options.checkpoint:
        return
    _check_writable("--checkpoint", Path(f"{options.checkpoint}.npz"), made=True)
    if not options.resume:
        found = checkpoint.existing(options.checkpoint) if rank == 0 else []
        if found and not options.overwrite:
            raise ValueError(f"--checkpoint {options.checkpoint}: {found[0]} is an earlier run's checkpoint; pass "
                             "--resume to continue it, --overwrite to replace it, or another prefix")
        return
    if parameter_server:
        if rank < options.servers:
            layout = ps.Layout.split(comm, model.size, options.servers)
            rule, _ = method.rule(options, len(layout.workers))
            checkpoint.check(checkpoint.path(options.checkpoint, "server", rank),
                             ps.server.checkpoint_identity(layout, rule, run))
    elif method.runner is _sandblaster:           # the coordinator's file and each shard's; workers keep none
        from ..sandblaster import checkpoint_file
        mine = checkpoint_file(options.checkpoint, rank, options.servers)
        if mine is not None:
            checkpoint.check(mine, run)
    else:
        checkpoint.check(_checkpoint_file(options, method, rank), run)


def reporting_rank(options: Options, method: "Method") -> int:
    """The rank that reports the run (progress, log, summary): the first worker."""
    if method.rule is not None:
        return options.servers * options.model_parallel
    return options.servers + 1 if method.runner is _sandblaster else 0


def _check_writable(option: str, path: Path, made: bool = False) -> None:
    """Raise unless a file can be written at ``path``: it is no folder, and its folder exists (or, ``made``,
    is made now) and takes a file (tried: permissions, a read-only mount, a full inode table)."""
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{option} {path}: that is a folder; name a file in it, e.g. {path / 'run.jsonl'}")
    if not made and not folder.is_dir():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mpicoll-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write a file in {folder} ({error.strerror or error}); "
                         "pick a writable folder") from None


def _checkpoint_file(options: Options, method: "Method", rank: int) -> Path:
    """The file this rank resumes from: one for allreduce methods (every rank holds the same), one per stage
    with ``--model-parallel`` (the replicas of a stage hold the same), one per rank for SGP."""
    if options.model_parallel > 1:
        return checkpoint.path(options.checkpoint, "stage", rank % options.model_parallel)
    return checkpoint.path(options.checkpoint, "rank" if method.runner is _sgp else None, rank)


def _setup(comm, options, data, xp, workers: tuple[int, ...], me: int | None = None):
    """(this rank's index among the workers, steps per epoch, its shard, its straggler); ``me``: the
    index when it is not this rank's place in ``workers`` (a model-parallel replica's)."""
    rank = comm.Get_rank()
    me = me if me is not None else workers.index(rank) if rank in workers else None
    steps = math.ceil(len(data.y) / (len(workers) * options.batch))      # per worker per epoch
    shard = data.shard(me, len(workers)) if me is not None else (data.X[:0], data.y[:0])
    X, y = xp.asarray(shard[0]), xp.asarray(shard[1])
    return me, steps, X, y, Straggler.for_rank(rank, options.straggler, options.delay, options.seed)


def _allreduce(comm, options, model, data, xp, method, run):
    """Allreduce SGD; with ``--model-parallel K``, of N/K replicas of a model cut into K pipelined stages
    (rank = replica x K + stage): each replica trains on its own shard through its pipeline, and the
    replicas of each stage average that stage's gradient, so every replica takes the step plain
    allreduce training over N/K ranks takes."""
    rank, size, k = comm.Get_rank(), comm.Get_size(), options.model_parallel
    replica, replicas = rank // k, size // k
    _, steps, X, y, slow = _setup(comm, options, data, xp, tuple(range(0, size, k)), me=replica)
    if k > 1:
        from ..modelparallel import stage
        pipe_comm, channel_comm = comm.Split(replica, rank), comm.Split(rank % k, rank)
        pipe = stage(pipe_comm, model, micro_batches=min(k, options.batch))
        params, gradient_of = xp.asarray(pipe.init(options.seed)), pipe.loss_and_gradient
    else:
        channel_comm, params, gradient_of = comm, model.init(options.seed), model.loss_and_gradient

    def test_score():       # (loss, accuracy) on the test set, on rank 0; through replica 0's pipeline
        if k == 1:
            return model.evaluate(params, reporter.X_test, reporter.y_test) if reporter else None
        if replica == 0:    # every stage of it takes part; none holds the whole model
            return pipe.evaluate(params, data.X_test, data.y_test)
        return None

    start = 0
    if options.resume:                       # every replica holds the same parameters: one file per stage
        state = load_checkpoint_set(comm, _checkpoint_file(options, method, rank), run, "epochs")
        params, start = xp.asarray(state["params"]), int(state["epoch"])
    average = xp.empty_like(params)
    lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
    with Communicator(channel_comm, algorithm=method.algorithm) as channel:
        reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
        for epoch in range(start, options.epochs):
            losses = []
            for step, batch in enumerate(_batches(len(y), options.batch, steps, [options.seed, replica, epoch])):
                with slow, timeline.span("gradient", "train"):
                    loss, grad = gradient_of(params, X[batch], y[batch])
                losses.append(loss)
                channel.Allreduce(grad, average)
                with timeline.span("update", "train"):
                    params -= (lr_at(epoch, step) / replicas) * average
            _stop_if_diverged(comm, params, [(epoch, losses)], f"after epoch {epoch + 1}")   # before saving it
            if options.checkpoint and replica == 0:     # the first replica: a file per stage (one stage: rank 0)
                checkpoint.save(_checkpoint_file(options, method, rank), run, epoch + 1,
                                params=arrays.as_host(params), epoch=epoch + 1)
            score = test_score()
            if reporter:
                reporter.evaluate(None, epoch + 1, (epoch + 1) * steps * options.batch * replicas, measured=score)
        final = test_score()
    if k > 1:
        pipe.close()
        pipe_comm.Free()
        channel_comm.Free()
    return reporter.finish(None, measured=final) if reporter else None


def _stop_if_diverged(comm, params, losses: list[tuple[int, list]], when: str) -> None:
    """Raise :class:`mpicoll.Diverged` on every rank alike if any rank's ``params`` hold NaN or Inf,
    naming the ranks whose training loss went bad first (``losses``: (epoch, that epoch's losses) per
    epoch, read only then).  Collective: one pass over the parameters and a small allgather."""
    with bounded(comm, "the divergence check"):
        finite = comm.allgather(all_finite(arrays.as_host(params)))
    if all(finite):
        return
    first = next(((epoch, step) for epoch, values in losses for step, loss in enumerate(values)
                  if not math.isfinite(float(loss))), None)
    with bounded(comm, "the divergence check"):
        firsts = comm.allgather(first)
    earliest = min((f for f in firsts if f is not None), default=None)
    if earliest is None:
        where = "no rank's loss was NaN or Inf first, so a gradient or an update overflowed"
    else:
        ranks = [rank for rank, f in enumerate(firsts) if f == earliest]
        where = (f"the loss first went NaN or Inf on rank(s) {', '.join(map(str, ranks))}, at step "
                 f"{earliest[1] + 1} of epoch {earliest[0] + 1}")
    raise Diverged(f"training diverged: the parameters hold NaN or Inf {when}; {where}. Try a smaller --lr")


def _sequential():
    """torch's nn.Sequential, or a class nothing is an instance of where torch is not installed."""
    try:
        from torch import nn
    except ImportError:
        return type("NoTorch", (), {})
    return nn.Sequential


def _check_model_parallel(options: Options, model: Model, method: "Method", size: int) -> None:
    k, downpour = options.model_parallel, method.name == "downpour"
    if (method.runner is not _allreduce or method.one_rank) and not downpour:
        raise ValueError(f"--model-parallel works with the allreduce methods and downpour, not {options.method}")
    from ..modelparallel import layer_sizes
    if not hasattr(model, "shapes") and not isinstance(getattr(model, "module", None), _sequential()):
        raise ValueError("--model-parallel cuts a sequence of layers: use --model mlp or softmax (numpy), or a torch "
                         "model whose module is an nn.Sequential (--framework torch --model mlp or cnn)")
    layers = len(layer_sizes(model))
    servers = k * options.servers if downpour else 0              # downpour: --servers shards per stage
    if k < 1 or (size - servers) % k or size - servers < k or k > layers:
        raise ValueError(f"--model-parallel {k}: the {size - servers} {'worker ' if downpour else ''}ranks must make "
                         f"whole replicas of {k} stages, and the model has {layers} layer(s) to share "
                         f"among them (e.g. mpiexec -n {servers + 2 * k}"
                         f"{f': {servers} servers, {options.servers} per stage, and 2 replicas' if downpour else ''})")
    if options.checkpoint and downpour:
        raise ValueError("downpour --model-parallel does not checkpoint yet: drop --checkpoint (the allreduce "
                         "methods do)")


def _check_memory(options: Options, model: Model, method: "Method", size: int) -> None:
    """Refuse a run whose ranks would hold more training state than ``--max-rank-memory``, saying which
    ``--model-parallel K`` would fit (the stage with the most state decides)."""
    if method.runner is not _allreduce or not hasattr(model, "state_bytes"):
        raise ValueError("--max-rank-memory is enforced for the allreduce methods on numpy dense models (mlp, "
                         "softmax): drop it, or use one of those")
    from ..modelparallel import layer_sizes, split
    layers = layer_sizes(model)

    def need(k: int) -> int:
        return max(model.state_bytes(options.batch, first, end) for first, end in split(layers, k))

    k, budget = options.model_parallel, options.max_rank_memory
    if need(k) <= budget:
        return
    fits = [j for j in range(k + 1, len(layers) + 1) if need(j) <= budget]
    advice = (f"--model-parallel {fits[0]} would fit (mpiexec -n a multiple of {fits[0]})" if fits else
              f"no cut of its {len(layers)} layers fits: each layer is one stage at most; use a smaller model or "
              f"batch, or more memory")
    raise ValueError(f"--max-rank-memory {budget:,} bytes: the model ({model.size:,} parameters) needs "
                     f"{need(k):,} bytes of training state per rank with --model-parallel {k} (parameters, gradient "
                     f"and allreduce result, and a batch of {options.batch} rows' activations); {advice}")


def _check_sandblaster(options: Options, size: int) -> None:
    if size < options.servers + 2:
        raise ValueError(f"sandblaster-lbfgs needs a coordinator, {options.servers} server shard(s) and at least one "
                         f"worker: mpiexec -n {options.servers + 2} or more, not {size}")
    from ..sandblaster import MAX_HISTORY
    if not 1 <= options.history <= MAX_HISTORY or options.lbfgs_batch < 0 or options.portions < 0:
        raise ValueError(f"--history must be 1 to {MAX_HISTORY} and --lbfgs-batch, --portions at least 0, got "
                         f"{options.history}, {options.lbfgs_batch}, {options.portions}")


def _sandblaster(comm, options, model, data, xp, method, run):
    """Sandblaster L-BFGS (mpicoll.sandblaster): rank 0 coordinates, ``--servers`` shards, the rest compute
    gradients over portions of the batch (the whole training set unless ``--lbfgs-batch``).  The budget:
    gradient evaluations worth ``epochs`` passes over the training set; the first worker reports after
    each accepted step that completes a pass."""
    from .. import sandblaster
    rank, samples = comm.Get_rank(), len(data.y)
    batch = options.lbfgs_batch or samples
    X, y = xp.asarray(data.X), xp.asarray(data.y)           # any worker may get any portion

    def loss_and_gradient(w, rows):
        loss, grad = model.loss_and_gradient(xp.asarray(w, model.dtype), X[rows], y[rows])
        return loss, arrays.as_host(grad)

    reporter_rank = options.servers + 1
    reporter = Reporter(options, model, data, xp, ranks=comm.Get_size()) if rank == reporter_rank else None
    reported = [0]

    def report(w, iteration, evaluations):               # on the first worker, after an accepted step
        epoch = min(evaluations * batch // samples, options.epochs)      # a last line search may run over
        if epoch > reported[0]:
            reported[0] = epoch
            reporter.evaluate(xp.asarray(w, model.dtype), epoch, evaluations * batch)

    result = sandblaster.run(
        comm, arrays.as_host(model.init(options.seed)), loss_and_gradient, samples=samples, batch=batch,
        servers=options.servers, history=options.history, iterations=10 ** 9, portions=options.portions or None,
        backup=options.backup, seed=options.seed, evaluations=math.ceil(options.epochs * samples / batch),
        slow=Straggler.for_rank(rank, options.straggler, options.delay, options.seed),
        on_report=report if reporter else None, checkpoint=options.checkpoint, resume=options.resume, identity=run)
    if result.role == "coordinator" and result.stopped and options.progress:
        print(f"sandblaster-lbfgs: stopped early: {result.stopped}", file=sys.stderr, flush=True)
    if reporter:
        final = xp.asarray(result.weights, model.dtype)
        return reporter.finish(final)
    return None


def _sgp(comm, options, model, data, xp, method, run):
    rank, size = comm.Get_rank(), comm.Get_size()
    _, steps, X, y, slow = _setup(comm, options, data, xp, tuple(range(size)))
    pushsum = gossip.PushSum(comm, model.init(options.seed), graph=options.graph, tau=options.tau,
                             mailbox=options.mailbox)
    sgp = gossip.SGP(pushsum, options.lr)
    start, mine = 0, _checkpoint_file(options, method, rank)
    if options.resume:                       # each rank its own numerator and push-sum weight
        state = load_checkpoint_set(comm, mine, run, "epochs")
        pushsum.load_state(state)
        start = int(state["epoch"])
    reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
    z = xp.asarray(sgp.parameters)
    lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
    losses = []                              # (epoch, its losses): where the parameters went bad, if they do
    for epoch in range(start, options.epochs):
        losses.append((epoch, []))
        for step, batch in enumerate(_batches(len(y), options.batch, steps, [options.seed, rank, epoch])):
            sgp.lr = lr_at(epoch, step)
            with slow, timeline.span("gradient", "train"):
                loss, grad = model.loss_and_gradient(z, X[batch], y[batch])
            losses[-1][1].append(loss)
            with timeline.span("push-sum step", "train"):
                z = xp.asarray(sgp.step(grad))
        if options.checkpoint:               # every rank is at the same round: nothing left in flight
            pushsum.drain()
            checkpoint.save(mine, run, epoch + 1, epoch=epoch + 1, **pushsum.state())
        if reporter:
            reporter.evaluate(z, epoch + 1, (epoch + 1) * steps * options.batch * size)
    pushsum.drain()
    consensus = np.empty_like(pushsum.x)                             # the model one would deploy: the average
    with Communicator(comm, algorithm="auto") as channel:
        channel.Allreduce(pushsum.debiased(), consensus)
    consensus /= size
    pushsum.close()
    # checked once, at the end: ranks hold different parameters, and asking after every epoch would make
    # every rank wait for the slowest there (the consensus is the same everywhere)
    _stop_if_diverged(comm, consensus, losses, "at the end (the average of the ranks' parameters)")
    return reporter.finish(xp.asarray(consensus)) if reporter else None


def _parameter_server(comm, options, model, data, xp, method, run):
    if options.model_parallel > 1:
        return _downpour_of_pipelines(comm, options, model, data, xp, method)
    rank, size = comm.Get_rank(), comm.Get_size()
    workers = tuple(range(options.servers, size))
    rule, per_update = method.rule(options, len(workers))
    server = ps.ParameterServer(comm, arrays.as_host(model.init(options.seed)), rule,
                                servers=options.servers, transport=options.transport)
    me, steps, X, y, slow = _setup(comm, options, data, xp, workers)
    state = None
    if options.resume:                      # the newest point every server's file holds (a stop between writes)
        mine = ps.server.checkpoint_file(options.checkpoint, server.layout) if server.is_server else None
        state = load_checkpoint_set(comm, mine, ps.server.checkpoint_identity(server.layout, rule, run)
                                    if server.is_server else {}, "updates")
    budget = options.epochs * steps * len(workers)        # gradients, over every worker
    reporter = Reporter(options, model, data, xp, ranks=size) if me == 0 else None
    if server.is_server:
        every = max(1, budget // options.epochs // per_update)       # updates per epoch
        server.serve(warm_start=options.warm_start, checkpoint=options.checkpoint, every=every,
                     resume=options.resume, identity=run, state=state,
                     lr_at=schedules.per_update(options.lr_schedule, options.lr, budget // per_update))
    else:
        client = server.client
        schedule = ps.Schedule(client, options.n_fetch, options.n_push) if method.name == "downpour" else None
        w = xp.asarray(client.pull())
        done = min(client.versions.values()) * per_update            # more than 0 when resumed
        reported = done * options.epochs // budget
        epoch, skip = divmod(done // len(workers), steps)            # where this worker's batches were
        while done < budget:
            batches = _batches(len(y), options.batch, steps, [options.seed, rank, epoch])[skip:]
            skip = 0
            for batch in batches:
                with slow, timeline.span("gradient", "train"):
                    loss, grad = model.loss_and_gradient(w, X[batch], y[batch])
                with timeline.span("exchange with the servers", "train"):
                    w = xp.asarray(schedule.step(arrays.as_host(grad)) if schedule else client.exchange(grad))
                done = min(client.versions.values()) * per_update     # gradients the servers have taken
                if done >= budget:
                    break
                if reporter and done * options.epochs // budget > reported:
                    reported = done * options.epochs // budget
                    reporter.evaluate(w, reported, done * options.batch)
            epoch += 1
        client.close()
    final = server.gather_weights()
    staleness = _staleness(server, workers[0])
    server.close()
    if server.lost and rank not in server.lost:
        # MPI_Finalize would wait for the lost ranks forever: once the result is out, every survivor
        # ends the job (one alone may not reach the others when a node is cut off)
        failure.end_at_exit(f"worker rank(s) {server.lost} were lost during training; the others finished")
    if reporter:
        reporter.evaluate(xp.asarray(final), options.epochs, budget * options.batch)
        return reporter.finish(xp.asarray(final), staleness=staleness)
    return None


def _downpour_of_pipelines(comm, options, model, data, xp, method):
    """Downpour over R replicas of a model cut into K pipelined stages (DistBelief): the first K x S ranks
    serve, S shards per stage, each stage's shards holding only that stage's layers; rank K x S +
    replica x K + stage computes that stage of that replica, and pushes its gradient to and fetches its
    weights from its own stage's shards only (one parameter server per stage, over that stage's ranks).
    Every replica takes ``epochs`` passes over its shard of the data."""
    from ..modelparallel import stage as cut, stage_init
    rank, size, k, per_stage = comm.Get_rank(), comm.Get_size(), options.model_parallel, options.servers
    servers = k * per_stage
    is_server = rank < servers
    stage = rank // per_stage if is_server else (rank - servers) % k
    replica, replicas = (None if is_server else (rank - servers) // k), (size - servers) // k
    stage_comm = comm.Split(stage, rank)                      # this stage's shards first, then its workers
    pipe_comm = comm.Split(MPI.UNDEFINED if is_server else replica, rank)
    rule, per_update = method.rule(options, replicas)
    server = ps.ParameterServer(stage_comm, arrays.as_host(stage_init(model, k, stage, options.seed)), rule,
                                servers=per_stage, transport=options.transport)
    _, steps, X, y, slow = _setup(comm, options, data, xp, tuple(range(replicas)), me=replica)
    reporter = Reporter(options, model, data, xp, ranks=size) if rank == servers else None
    pipe = None if is_server else cut(pipe_comm, model, micro_batches=min(k, options.batch))
    if is_server:
        budget = options.epochs * steps * replicas                      # gradients into each stage
        server.serve(warm_start=options.warm_start,
                     lr_at=schedules.per_update(options.lr_schedule, options.lr, budget // per_update))
    else:
        schedule = ps.Schedule(server.client, options.n_fetch, options.n_push)
        w = xp.asarray(server.client.pull())
        for epoch in range(options.epochs):
            for batch in _batches(len(y), options.batch, steps, [options.seed, replica, epoch]):
                with slow, timeline.span("gradient", "train"):
                    loss, grad = pipe.loss_and_gradient(w, X[batch], y[batch])
                with timeline.span("exchange with the servers", "train"):
                    w = xp.asarray(schedule.step(arrays.as_host(grad)))
            score = pipe.evaluate(w, data.X_test, data.y_test) if replica == 0 else None
            if reporter:
                reporter.evaluate(None, epoch + 1, (epoch + 1) * steps * options.batch * replicas, measured=score)
        server.client.close()
    final = server.gather_weights()                           # this stage's, on every rank of the stage
    server.close()
    score = pipe.evaluate(xp.asarray(final), data.X_test, data.y_test) if replica == 0 else None
    if pipe:
        pipe.close()
        pipe_comm.Free()
    stage_comm.Free()
    return reporter.finish(None, measured=score) if reporter else None


STALENESS_BINS = 64        # lags counted one by one; longer ones share the last bin


def _staleness(server: ps.ParameterServer, reporter: int) -> dict[int, int] | None:
    """The first server's staleness histogram {updates between a gradient's weights and its use: count},
    sent to the reporting worker, which writes the log; None on every other rank."""
    layout, ctx = server.layout, server.context
    first, counts = layout.servers[0], np.zeros(STALENESS_BINS + 1, np.int64)
    if layout.rank == first and reporter not in server.lost:
        for lag, count in server.stats.staleness.items():
            counts[min(lag, STALENESS_BINS)] += count
        ctx.wait(ctx.isend(counts, reporter, Tag.PS_STATS), reporter)
    elif layout.rank == reporter:
        ctx.wait(ctx.irecv(counts, first, Tag.PS_STATS), first)
        return {lag: int(count) for lag, count in enumerate(counts) if count}
    return None


@dataclass(frozen=True)
class Method:
    """One way of training: its name, its runner, and what the runner needs to know."""

    name: str
    runner: Callable
    algorithm: str | None = None           # allreduce methods: the collective algorithm
    rule: Callable | None = None           # parameter servers: (options, workers) -> (rule, gradients per update)
    one_rank: bool = False                 # runs on one process only (the sequential reference)

    @property
    def min_ranks(self) -> int:
        """The fewest ranks it runs on (with one server): a server and a worker; a coordinator, a shard and
        a worker."""
        return 3 if self.runner is _sandblaster else 2 if self.rule is not None else 1


def _softsync(options, workers):
    k = options.softsync_k
    return ps.SoftSync(options.lr, k), (math.ceil(k * workers) if k < 1 else int(k))


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("allreduce-ring", _allreduce, algorithm="ring"),
    Method("allreduce-parallel", _allreduce, algorithm="parallel"),
    Method("allreduce-auto", _allreduce, algorithm="auto"),
    Method("ps-sync", _parameter_server, rule=lambda o, workers: (ps.Sync(o.lr), workers)),
    Method("ps-softsync", _parameter_server, rule=_softsync),
    Method("ps-async", _parameter_server, rule=lambda o, workers: (ps.Async(o.lr, o.staleness), 1)),
    Method("dcasgd", _parameter_server, rule=lambda o, workers: (ps.DCASGD(o.lr, o.lam, adaptive=o.adaptive), 1)),
    Method("downpour", _parameter_server, rule=lambda o, workers: (ps.Downpour(o.lr), o.n_push)),
    Method("sgp", _sgp),
    Method("sequential", _allreduce, algorithm="auto", one_rank=True),     # one process: plain SGD
    Method("sandblaster-lbfgs", _sandblaster),
)}
