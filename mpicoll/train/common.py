"""What every family of training methods shares: the options, the batches, a worker's shard, the checks
before a job starts, the divergence check, and :class:`Family`, the questions each family answers for itself
(:mod:`.allreduce`, :mod:`.parameter_servers`, :mod:`.sgp`, :mod:`.lbfgs`)."""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import arrays
from ..base import checkpoint
from ..base.errors import Diverged, MpicollError
from ..base.straggler import Straggler
from ..channel.checks import all_finite
from ..channel.watchdog import bounded
from ..models.dense import Model
from .data import Dataset

__all__ = ["Options", "Family", "batches", "steps_per_epoch", "setup", "check_writable", "stop_if_diverged",
           "check_whole_replicas"]


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
    ringmaster_r: int = 0             # ringmaster: drop gradients this many updates late (0: the workers' count)
    n_fetch: int = 1                  # downpour
    n_push: int = 1
    warm_start: int = 0
    transport: str = "p2p"            # ps and sgp: how ranks exchange, p2p messages or onesided windows
    graph: str = "time-varying-exponential"
    tau: int = 0                      # sgp overlap
    model_parallel: int = 1           # allreduce methods: stages per replica (mpicoll.modelparallel)
    max_rank_memory: int = 0          # allreduce methods: bytes of training state one rank may hold (0: no limit)
    compression: str | None = None    # allreduce methods: gradients moved as fp16 or bf16 (collectives.compression),
    error_feedback: bool = False      # or powersgd; fp16/bf16: each step's rounding carried into the next
    powersgd_rank: int = 2            # --compression powersgd: the rank of each matrix's approximation
    powersgd_start: int = 10          # --compression powersgd: steps averaged exactly first
    distributed_optimizer: bool = False   # torch modules: averaged by mpicoll.torch.DistributedOptimizer's buckets
    sync_every: int = 16              # localsgd, diloco: inner steps between the replicas' meetings
    inner_optimizer: str = "sgd"      # localsgd, diloco: sgd or adamw
    inner_momentum: float = 0.0       # localsgd, diloco: the inner SGD's momentum
    weight_decay: float = 0.0         # localsgd, diloco: the inner optimizer's
    outer_lr: float = 0.7             # diloco: the outer SGD's rate and momentum (Nesterov unless --no-nesterov)
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1                # localsgd, diloco: streaming fragments, each meeting at its own offset
    overlap: int = 0                  # localsgd, diloco: inner steps a fragment's sum travels before it is applied
    mix: float = 0.0                  # localsgd, diloco: a replica's own share of a fragment after its meeting
    history: int = 10                 # sandblaster-lbfgs: L-BFGS pairs kept
    lbfgs_batch: int = 0              # sandblaster-lbfgs: rows per iteration (0: all, full-batch L-BFGS)
    portions: int = 0                 # sandblaster-lbfgs: pieces per gradient evaluation (0: 4 per worker)
    backup: bool = True               # sandblaster-lbfgs: backup copies of the slowest portions
    output: str | None = None         # JSON lines log
    checkpoint: str | None = None     # path prefix: state saved after every epoch
    resume: bool = False              # continue from the checkpoint
    overwrite: bool = False           # a fresh run may replace an earlier run's checkpoint
    elastic: bool = False             # go on without lost ranks (ULFM: mpicoll.train.elastic)
    min_ranks: int = 1                # --elastic: stop, cleanly, below this many ranks
    progress: bool = True

    @classmethod
    def from_args(cls, args) -> "Options":
        """The options of an ``mpicoll train`` command line (every field of the same name)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**given, progress=not getattr(args, "quiet", False))


def steps_per_epoch(rows: int, workers: int, batch: int) -> int:
    """The steps each of ``workers`` takes in a pass over ``rows`` rows, ``batch`` rows a step (a shard that runs
    short goes on into its next permutation, :func:`batches`)."""
    return math.ceil(rows / (workers * batch))


def batches(rows: int, batch: int, steps: int, seed) -> list[np.ndarray]:
    """``steps`` batches of row indices from a fresh permutation per pass (same on every run)."""
    rng, order, out = np.random.default_rng(seed), np.empty(0, np.int64), []
    while len(out) < steps:
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(rows)])
        out.append(order[:batch])
        order = order[batch:]
    return out


def setup(comm, options, data, xp, workers: tuple[int, ...], me: int | None = None):
    """(this rank's index among the workers, steps per epoch, its shard, its straggler); ``me``: the
    index when it is not this rank's place in ``workers`` (a model-parallel replica's)."""
    rank = comm.Get_rank()
    me = me if me is not None else workers.index(rank) if rank in workers else None
    steps = steps_per_epoch(len(data.y), len(workers), options.batch)
    shard = data.shard(me, len(workers)) if me is not None else (data.X[:0], data.y[:0])
    X, y = xp.asarray(shard[0]), xp.asarray(shard[1])
    return me, steps, X, y, Straggler.for_rank(rank, options.straggler, options.delay, options.seed)


def check_writable(option: str, path: Path, made: bool = False) -> None:
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


def stop_if_diverged(comm, params, losses: list[tuple[int, list]], when: str) -> None:
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


def check_whole_replicas(options: "Options", model: Model, size: int, servers: int = 0, workers: str = "") -> None:
    """Raise unless ``--model-parallel K`` cuts ``model`` (a sequence of layers) into whole replicas of K stages
    on the ``size - servers`` ranks that compute (``workers``: how the message names them)."""
    from ..modelparallel import layer_sizes
    k = options.model_parallel
    if not hasattr(model, "shapes") and not isinstance(getattr(model, "module", None), _sequential()):
        raise ValueError("--model-parallel cuts a sequence of layers: use --model mlp or softmax (numpy), or a torch "
                         "model whose module is an nn.Sequential (--framework torch --model mlp or cnn)")
    layers = len(layer_sizes(model))
    if k < 1 or (size - servers) % k or size - servers < k or k > layers:
        raise ValueError(f"--model-parallel {k}: the {size - servers} {workers}ranks must make "
                         f"whole replicas of {k} stages, and the model has {layers} layer(s) to share "
                         f"among them (e.g. mpiexec -n {servers + 2 * k}"
                         f"{f': {servers} servers, {options.servers} per stage, and 2 replicas' if servers else ''})")


class Family:
    """A family of training methods, answering for itself what the rest of ``mpicoll train`` needs: its option
    checks, the ranks it needs, which rank reports, where its checkpoints are, and how it runs.  A row of
    :data:`mpicoll.train.run.METHODS` is one family object with its arguments (an algorithm, a rule)."""

    min_ranks = 1            # the fewest ranks it runs on (with one server)
    one_rank = False         # runs on one process only (the sequential reference)
    reports_staleness = False    # its summary counts how stale the gradients were (parameter servers)
    # how a checkpoint of it continues on another number of ranks ("": it cannot, and a resume at another count
    # is refused with ``fixed_ranks`` as the reason)
    reshards = ""
    fixed_ranks = "its state is tied to the number of ranks that wrote it"

    def __init__(self, name: str):
        self.name = name

    def fits(self, ranks: int) -> bool:
        """Whether it runs on ``ranks`` ranks (the sequential reference runs on one, whatever is asked)."""
        return self.one_rank or ranks >= self.min_ranks

    def workers(self, options: Options, size: int) -> int:
        """How many of ``size`` ranks compute gradients (each needs a shard of the data)."""
        return size

    def reporting_rank(self, options: Options) -> int:
        """The rank that reports the run (progress, log, summary): the first worker."""
        return 0

    def check(self, options: Options, model: Model, size: int) -> None:
        """Raise (on this rank) what stops this family on ``size`` ranks; the checks of every family ran."""

    def check_model_parallel(self, options: Options, model: Model, size: int) -> None:
        raise ValueError(f"--model-parallel works with the allreduce methods and downpour, not {self.name}")

    def check_elastic(self, options: Options, model: Model, size: int) -> None:
        """Raise unless this family can go on without lost ranks (``--elastic``)."""
        raise ValueError(f"--elastic works with the allreduce methods and sgp, not {self.name} (the parameter "
                         "servers already go on without a lost worker)")

    def check_compression(self, options: Options, model: Model) -> None:
        """Raise unless this family can move its gradients compressed (``--compression``)."""
        raise ValueError(f"--compression works with the allreduce methods, not {self.name}")

    def check_distributed_optimizer(self, options: Options, model: Model) -> None:
        """Raise unless this family can average through mpicoll.torch.DistributedOptimizer."""
        raise ValueError(f"--distributed-optimizer works with the allreduce methods, not {self.name}")

    def check_memory(self, options: Options, model: Model, size: int) -> None:
        raise ValueError("--max-rank-memory is enforced for the allreduce methods on numpy dense models (mlp, "
                         "softmax): drop it, or use one of those")

    def checkpoint_file(self, options: Options, rank: int) -> Path | None:
        """The file this rank saves to and resumes from (None: it keeps none); a family that checks its resume
        otherwise need not say."""
        raise NotImplementedError

    def last_checkpoint(self, options: Options, ranks, unit: str) -> str:
        """For the line that ends a run which lost a rank it cannot go on without: the newest point the files
        of ``ranks`` all hold (what ``--resume`` takes, :func:`mpicoll.channel.checks.load_checkpoint_set`),
        or why there is none to name.  Read while living ranks may still be writing theirs: a point every
        file holds now, the newest or the one kept before it, is one they all still hold after one more write."""
        if not options.checkpoint:
            return "nothing was saved (no --checkpoint): the run must start over"
        try:
            held = [set(checkpoint.versions(self.checkpoint_file(options, rank), {})) for rank in ranks]
        except (OSError, MpicollError):
            return (f"no whole set of checkpoint files under --checkpoint {options.checkpoint} was found from this "
                    "rank (none written yet, or on another node's disk)")
        common = set.intersection(*held)
        if not common:
            listing = "; ".join(f"rank {rank}: {', '.join(map(str, sorted(points)))}"
                                for rank, points in zip(ranks, held))
            return (f"the checkpoint files under --checkpoint {options.checkpoint} hold no {unit} in common "
                    f"({listing}): the run must start over")
        return (f"the last checkpoint, --checkpoint {options.checkpoint}, holds {unit} {max(common)}: go on from it "
                "with the same command and --resume")

    def earlier_ranks(self, options: Options, run: dict) -> int:
        """How many ranks the run had whose checkpoint ``--resume`` continues (its first file says)."""
        return int(checkpoint.stamp(self.checkpoint_file(options, 0), checkpoint.without_ranks(run))["ranks"])

    def check_resume(self, comm: MPI.Intracomm, options: Options, model: Model, run: dict) -> None:
        """Raise unless this rank's checkpoint belongs to the run ``run`` describes, at this rank count or (a
        family that :attr:`reshards`) at any."""
        self.check_rank_count(comm, options, run)
        mine = self.checkpoint_file(options, comm.Get_rank())
        if mine is not None:
            checkpoint.check(mine, checkpoint.without_ranks(run) if self.reshards else run)

    def check_rank_count(self, comm: MPI.Intracomm, options: Options, run: dict) -> int:
        """The earlier run's rank count; raises, saying why, where it is not this one's and this family's state
        cannot move to another count."""
        earlier, size = self.earlier_ranks(options, run), comm.Get_size()
        if earlier != size and not self.reshards:
            raise ValueError(f"--resume: {options.checkpoint} was written by a run of {earlier} ranks, and "
                             f"{options.method} cannot continue it on {size}: {self.fixed_ranks}. Resume it with "
                             f"mpiexec -n {earlier}")
        return earlier

    def say_resharded(self, comm: MPI.Intracomm, options: Options, earlier: int) -> None:
        """Say, once, that this run continues a checkpoint of ``earlier`` ranks on another count, and how."""
        if earlier != comm.Get_size() and comm.Get_rank() == 0:
            print(f"mpicoll train: resuming {options.checkpoint}, written by {earlier} ranks, on {comm.Get_size()}: "
                  f"{self.reshards}", file=sys.stderr, flush=True)

    def run(self, comm: MPI.Intracomm, options: Options, model: Model, data: Dataset, xp, run: dict) -> dict | None:
        """Train; the summary record on the reporting rank, None elsewhere."""
        raise NotImplementedError
