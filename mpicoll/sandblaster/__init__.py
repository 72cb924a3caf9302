"""Sandblaster L-BFGS (Dean et al., 2012): a coordinator runs L-BFGS through commands that sharded
parameter servers execute on their own slices, while workers compute gradients over portions of
the batch handed out as they become free, with backup tasks for the slowest.

    from mpi4py import MPI
    from mpicoll import sandblaster

    def loss_and_gradient(w, rows):            # mean loss over those training rows, and its gradient
        ...

    result = sandblaster.run(MPI.COMM_WORLD, w0, loss_and_gradient, samples=len(y), servers=1,
                             iterations=50)
    # workers: result.weights is the final parameter vector; shards: their slice; rank 0: None

Run with ``mpiexec -n 1+S+W``: rank 0 coordinates, ranks 1..S serve a shard
each, the rest are workers.  **How to choose S**: a shard holds 5 + 2m vectors'
slices (m = ``history``) and does O(n/S) work per command (O((2m + 1) n/S) for the
direction's combination), about 8 commands per iteration and 3 per line-search trial;
the coordinator waits on the slowest shard for each round trip.
One shard is right until the vectors (8(5 + 2m) n bytes: 2 GB for 10M parameters
and m = 10) no longer fit one rank's memory, or the shard's arithmetic per
command approaches the workers' gradient time; every rank given to a shard is
one fewer computing gradients.  ``mpiexec -n 5``: 1 shard, 3 workers.

The parts: :mod:`.lbfgs` (the optimizer over named vectors, and the
single-process reference), :mod:`.coordinator` (commands, portions, backup
tasks), :mod:`.server` (a shard), :mod:`.worker`, :mod:`.protocol` (roles and messages).

**When a part dies.**  A *worker*: its portion is handed to another worker
(at once as a backup task when one is free, else after ``MPICOLL_TIMEOUT`` of
silence, after which it gets no more work); training goes on, the survivors get
the result, and the job then ends at exit (MPI cannot finalize with a rank gone).
A *server shard*: its slice of the parameters and of the L-BFGS history is gone,
so nothing can go on: the coordinator's next command times out, it names the
shard and tells every rank, and all stop with an error.  The *coordinator*:
the shards and workers wait for its next command or task, time out naming
it, tell each other, and stop.  Either way no rank hangs past ``MPICOLL_TIMEOUT``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..base import checkpoint as checkpoints
from ..base import failure
from ..channel import notices
from ..channel.checks import load_checkpoint_set
from ..channel.context import Context
from ..base.errors import PartFailed
from ..base.tags import Tag
from .coordinator import RemoteVectors, Stats, WorkersLost
from .lbfgs import LBFGS, Iteration, LocalVectors, history_names
from .protocol import COMMAND_WORDS, Roles, batch_rows
from .server import Shard
from .worker import Worker

__all__ = ["run", "checkpoint_file", "Result", "Roles", "LBFGS", "LocalVectors", "Iteration", "Stats", "WorkersLost",
           "batch_rows", "minimize_locally"]


MAX_HISTORY = ((COMMAND_WORDS - 3) // 2 - 1) // 2      # 2m + 1 terms in one COMBINATION command


@dataclass
class Result:
    """One rank's outcome of :func:`run`."""

    role: str                                      # coordinator, server or worker
    weights: np.ndarray | None                     # workers: the final parameters; shards: their slice
    iterations: list = field(default_factory=list)       # coordinator: one Iteration per accepted step
    stats: Stats | None = None                     # coordinator: evaluations, backups, lost workers, ...
    stopped: str = ""                              # coordinator: why L-BFGS stopped early, if it did
    portions: int = 0                              # worker: portions it computed
    lost: list = field(default_factory=list)       # coordinator and workers: the workers lost


def run(comm: MPI.Intracomm, init: np.ndarray, loss_and_gradient: Callable, *, samples: int,
        batch: int | None = None, servers: int = 1, history: int = 10, iterations: int = 100,
        evaluations: int | None = None, portions: int | None = None, backup: bool = True, tolerance: float = 1e-10, seed: int = 0,
        slow=None, on_iteration: Callable[[Iteration], None] | None = None,
        on_report: Callable | None = None, checkpoint: str | None = None, resume: bool = False,
        identity: dict | None = None) -> Result:
    """Minimise the mean loss over ``samples`` training rows with Sandblaster L-BFGS; collective over ``comm``.

    ``loss_and_gradient(w, rows)`` (workers only; ``w`` float64, ``rows`` indices
    into the training data) returns the mean loss over those rows and its
    gradient.  ``batch``: rows per iteration (default all: full-batch L-BFGS; fewer
    draws a new batch each iteration, on which the gradient at the current point
    is recomputed so each history pair compares gradients of one function).
    ``iterations``: accepted steps at most; ``evaluations``: no new step once that
    many gradient evaluations are spent (a budget in passes over the data).
    ``portions``: pieces each gradient evaluation is cut into (default 4 per
    worker); ``backup``: hand out backup copies of the slowest portions.
    ``on_iteration(Iteration)`` runs on the coordinator after each accepted step;
    ``on_report(w, iteration, evaluations)`` on the first worker, with its parameters.
    ``slow``: a :class:`~mpicoll.base.straggler.Straggler` around each of this worker's portions.
    ``checkpoint``: a path prefix; after every accepted step each shard writes its slices of x, g and
    the history (``PREFIX.server<r>.npz``) and then the coordinator the optimizer's scalars
    (``PREFIX.npz``); ``resume`` continues from them, the same iterates as a run never stopped.
    ``identity``: what else the files must match on resuming (the run's method, model, data).
    """
    if not 1 <= history <= MAX_HISTORY:
        raise ValueError(f"history must be 1 to {MAX_HISTORY} pairs (a direction combines 2m + 1 vectors in one "
                         f"command), got {history}")
    init = np.ravel(np.asarray(init, np.float64))
    roles = Roles(init.size, comm.Get_size(), servers)
    batch = samples if batch is None else batch
    if batch < 1 or samples < 1:
        raise ValueError(f"Sandblaster needs at least one sample per batch, got batch={batch}, samples={samples}")
    names = history_names(history)
    identity = {**(identity or {}), "parameters": int(init.size), "servers": servers, "history": history,
                "batch": batch, "samples": samples}
    # the workers hold no state: a checkpoint resumes on any number of them (the rank count is not matched)
    saved = _resume(comm, roles, checkpoint, checkpoints.without_ranks(identity)) if resume else None
    ctx = Context(comm, "Sandblaster L-BFGS")
    ctx.on_death = "acknowledge"          # under ULFM a dead worker is lost, as a silent one is without it
    rank = ctx.rank
    everyone_else = [r for r in range(roles.ranks) if r != rank]
    notices.listen(ctx, everyone_else, Tag.SANDBLASTER_FAILED, PartFailed)
    role, lost = roles.role(rank), []
    try:
        if role == "coordinator":
            vectors = RemoteVectors(ctx, roles, names, samples=samples, batch=batch, backup=backup,
                                    portions=portions or 4 * len(roles.workers))
            optimizer = LBFGS(vectors, history, tolerance)
            if saved:
                optimizer.load_state(saved)

            def accepted(step: Iteration) -> None:
                if checkpoint:                      # the shards' files first: this one says the set is whole
                    vectors.save(step.number)
                    checkpoints.save(checkpoint_file(checkpoint, rank, servers), identity, step.number,
                                     iteration=np.array(step.number), **optimizer.state())
                vectors.report(step.number, step.evaluations)
                if on_iteration:
                    on_iteration(step)

            steps = optimizer.minimize(iterations, (lambda k: 0) if batch >= samples else (lambda k: k), accepted,
                                       evaluations, start=int(saved["iteration"]) if saved else 0)
            lost = vectors.finish()
            result = Result(role, None, steps, vectors.stats, optimizer.stopped, lost=lost)
        elif role == "server":
            saving = (checkpoint_file(checkpoint, rank, servers), identity) if checkpoint else None
            result = Result(role, Shard(ctx, roles, names, init, saving, saved).run())
        else:
            worker = Worker(ctx, roles, loss_and_gradient, samples, batch, seed, slow, on_report)
            result = Result(role, worker.run(), portions=worker.portions, lost=worker.lost)
            lost = worker.lost
    except Exception as error:
        if not isinstance(error, PartFailed):         # the others stop now, not at their timeout
            notices.tell(ctx, everyone_else, error, Tag.SANDBLASTER_FAILED)
        ctx.broken_by(error)
        ctx.free(abandon=True)
        raise
    if failure.fault_tolerant() and failure.meet_survivors(ctx.comm, bool(lost)):
        failure.outlived_a_death()          # every survivor, the workers that never heard of it too
    elif lost:
        failure.end_at_exit(f"Sandblaster worker rank(s) {lost} were lost during training; the others finished",
                            ctx.world_ranks(lost))
    ctx.free(abandon=bool(lost))
    return result


def checkpoint_file(prefix: str, rank: int, servers: int):
    """The checkpoint file rank ``rank`` writes with ``servers`` shards: the coordinator's (the optimizer's
    scalars, ``PREFIX.npz``), a shard's (its vectors, ``PREFIX.server<r>.npz``), or None (a worker)."""
    if rank == Roles.coordinator:
        return checkpoints.path(prefix)
    return checkpoints.path(prefix, "server", rank) if rank <= servers else None


def _resume(comm, roles: Roles, prefix: str, identity: dict) -> dict | None:
    """This rank's checkpoint (the coordinator's scalars, a shard's vectors; None on workers), refused on
    every rank alike if any file is missing, belongs to another run, or was written after another step
    than the others (a run stopped between its files' writes).  Collective."""
    rank = comm.Get_rank()
    mine = checkpoint_file(prefix, rank, roles.servers) if roles.role(rank) != "worker" else None
    return load_checkpoint_set(comm, mine, identity, "steps")


def minimize_locally(init: np.ndarray, loss_and_gradient: Callable, *, history: int = 10, iterations: int = 100,
                     tolerance: float = 1e-10, batch_of: Callable[[int], int] = lambda k: 0,
                     on_iteration=None) -> tuple[np.ndarray, list[Iteration], str]:
    """The same L-BFGS in this process, over ``loss_and_gradient(w, batch number)`` (``batch_of(k)``:
    iteration k's): (final parameters, iterations, why it stopped early if it did).  The reference
    Sandblaster's iterates are tested against."""
    vectors = LocalVectors(init, loss_and_gradient, history)
    optimizer = LBFGS(vectors, history, tolerance)
    steps = optimizer.minimize(iterations, batch_of, on_iteration)
    return vectors.vectors["x"], steps, optimizer.stopped
