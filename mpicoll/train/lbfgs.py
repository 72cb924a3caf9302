"""The Sandblaster family: ``sandblaster-lbfgs``, DistBelief's batch L-BFGS (:mod:`mpicoll.sandblaster`)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from .. import arrays
from ..base.errors import CollectiveTimeout, MpicollError, PartFailed, PeerFailed
from ..base.straggler import Straggler
from ..models.dense import Model
from .common import Family, Options
from .report import Reporter

__all__ = ["Lbfgs"]


class Lbfgs(Family):
    """Rank 0 coordinates, ``--servers`` shards hold the vectors, the rest compute gradients."""

    min_ranks = 3            # a coordinator, a shard and a worker
    reshards = ("the coordinator and the server shards hold the L-BFGS state and the workers none: the new "
                "workers share the gradient's portions")

    def reporting_rank(self, options: Options) -> int:
        return options.servers + 1

    def checkpoint_file(self, options: Options, rank: int) -> Path | None:
        """The coordinator's file and each shard's; workers keep none."""
        from ..sandblaster import checkpoint_file
        return checkpoint_file(options.checkpoint, rank, options.servers)

    def check(self, options: Options, model: Model, size: int) -> None:
        if size < options.servers + 2:
            raise ValueError(f"sandblaster-lbfgs needs a coordinator, {options.servers} server shard(s) and at least "
                             f"one worker: mpiexec -n {options.servers + 2} or more, not {size}")
        from ..sandblaster import MAX_HISTORY
        if not 1 <= options.history <= MAX_HISTORY or options.lbfgs_batch < 0 or options.portions < 0:
            raise ValueError(f"--history must be 1 to {MAX_HISTORY} and --lbfgs-batch, --portions at least 0, got "
                             f"{options.history}, {options.lbfgs_batch}, {options.portions}")

    def run(self, comm, options, model, data, xp, run):
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

        reports = rank == self.reporting_rank(options)
        reporter = Reporter(options, model, data, xp, ranks=comm.Get_size()) if reports else None
        reported, started = [0], time.perf_counter()
        evaluations = math.ceil(options.epochs * samples / batch)         # the budget: epochs of gradients

        def report(w, iteration, evaluations):               # on the first worker, after an accepted step
            epoch = min(evaluations * batch // samples, options.epochs)      # a last line search may run over
            if epoch > reported[0]:
                reported[0] = epoch
                reporter.evaluate(xp.asarray(w, model.dtype), epoch, evaluations * batch)

        if options.resume:
            self.say_resharded(comm, options, self.check_rank_count(comm, options, run))
        try:
            result = sandblaster.run(
                comm, arrays.as_host(model.init(options.seed)), loss_and_gradient, samples=samples, batch=batch,
                servers=options.servers, history=options.history, iterations=10 ** 9,
                portions=options.portions or None, backup=options.backup, seed=options.seed,
                evaluations=evaluations,
                slow=Straggler.for_rank(rank, options.straggler, options.delay, options.seed),
                on_report=report if reporter else None, checkpoint=options.checkpoint, resume=options.resume,
                identity=run)
        except (PeerFailed, CollectiveTimeout, PartFailed) as error:
            if not _a_part_lost(error, options.servers):
                raise
            raise MpicollError(f"{error}; {self.last_checkpoint(options, range(options.servers + 1), 'iteration')}"
                               ) from None
        if result.role == "coordinator" and result.stopped and options.progress:
            print(f"sandblaster-lbfgs: stopped early: {result.stopped}", file=sys.stderr, flush=True)
        first = self.reporting_rank(options)
        if result.role == "worker" and first in result.lost and rank == min(set(range(first, comm.Get_size())) -
                                                                            set(result.lost)):
            reporter = Reporter.take_over(options, model, data, xp, comm.Get_size(), started)  # its writer died
            reporter.samples = evaluations * batch                                      # the budget, all taken
        if reporter:
            final = xp.asarray(result.weights, model.dtype)
            return reporter.finish(final, workers_lost=result.lost)
        return None


def _a_part_lost(error: Exception, servers: int) -> bool:
    """Whether ``error`` says the coordinator or a shard (the first ``servers`` + 1 ranks) is gone, as this rank
    heard it or another told it (a worker lost is not an error: its portions go to the others)."""
    if isinstance(error, PartFailed):
        return error.says_ranks_died()
    return any(peer <= servers for peer in error.peers)
