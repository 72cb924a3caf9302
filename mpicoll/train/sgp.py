"""The gossip family: ``sgp``, Stochastic Gradient Push (:mod:`mpicoll.gossip`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import gossip
from ..base import checkpoint, timeline
from ..channel.checks import load_checkpoint_set
from ..collectives.communicator import Communicator
from . import schedule as schedules
from .common import Family, Options, batches, setup, stop_if_diverged
from .report import Reporter

__all__ = ["Sgp"]


class Sgp(Family):
    """Every rank a worker; each step a local SGD step, then one push-sum gossip round."""

    def checkpoint_file(self, options: Options, rank: int) -> Path:
        """One file per rank: each holds its own numerator and push-sum weight."""
        return checkpoint.path(options.checkpoint, "rank", rank)

    def run(self, comm, options, model, data, xp, run):
        rank, size = comm.Get_rank(), comm.Get_size()
        _, steps, X, y, slow = setup(comm, options, data, xp, tuple(range(size)))
        pushsum = gossip.PushSum(comm, model.init(options.seed), graph=options.graph, tau=options.tau,
                                 mailbox=options.transport)
        sgp = gossip.SGP(pushsum, options.lr)
        start, mine = 0, self.checkpoint_file(options, rank)
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
            for step, batch in enumerate(batches(len(y), options.batch, steps, [options.seed, rank, epoch])):
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
        with Communicator(comm, algorithm="auto") as everyone:
            everyone.Allreduce(pushsum.debiased(), consensus)
        consensus /= size
        pushsum.close()
        # checked once, at the end: ranks hold different parameters, and asking after every epoch would make
        # every rank wait for the slowest there (the consensus is the same everywhere)
        stop_if_diverged(comm, consensus, losses, "at the end (the average of the ranks' parameters)")
        return reporter.finish(xp.asarray(consensus)) if reporter else None
